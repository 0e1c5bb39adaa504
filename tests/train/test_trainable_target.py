"""The trainable target (train/model/) against the fp32 reference it twins.

The same canonical weights go into ``ReferenceTarget`` / ``ReferenceMTP`` (per sequence, explicit
caches, the recurrent delta rule) and ``TrainableTarget`` (batched, chunked, no cache); logits,
hidden and taps must agree to fp32 rounding. The chunked rule is also checked on its own
(values, gradients, fp32 inside autocast), and the forward is watched at the aten level for host
syncs and for work that grows with T inside a chunk (a loop over tokens).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash2.reference.formats.errors import CheckpointError, ConfigError, RequestError
from dflash2.reference.formats.weights import expected_target_shapes
from dflash2.reference.model.delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent
from dflash2.reference.model.mtp import ReferenceMTP
from dflash2.reference.model.target import ReferenceTarget
from dflash2.reference.tiny.target import tiny_target_config, tiny_target_weights
from dflash2.train.model.gdn import chunk_gated_delta_rule, l2norm
from dflash2.train.model.target import TrainableTarget

TOL = 2e-5  # RMS-relative, fp32 against fp32 (observed about 1e-6 to 5e-6)
SEQ_LEN = 70  # more than one chunk at every chunk size tested


def rms_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def rule_inputs(n: int, steps: int, heads: int, dk: int, dv: int, seed: int, dtype=torch.float32):
    """Delta-rule inputs as the layer hands them over: unit keys, queries scaled by 1/sqrt(Dk)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, steps, heads, dk, generator=gen, dtype=dtype)) / dk ** 0.5
    k = l2norm(torch.randn(n, steps, heads, dk, generator=gen, dtype=dtype))
    v = torch.randn(n, steps, heads, dv, generator=gen, dtype=dtype)
    g = -torch.rand(n, steps, heads, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(n, steps, heads, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-dense-text"])
def twins(request):
    """(cfg, canonical weights, reference target, token ids [2, SEQ_LEN]); tiny-dense-text is tied, no MTP."""
    cfg = tiny_target_config(request.param)
    weights = tiny_target_weights(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(11))
    return cfg, weights, ReferenceTarget(cfg, weights), ids


# --- the chunked rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 64, 7, 128])
def test_chunk_rule_equals_reference_rules_per_sequence(chunk_size):
    q, k, v, g, beta = rule_inputs(2, SEQ_LEN, 3, 8, 5, seed=0)
    o = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size)
    assert o.shape == (2, SEQ_LEN, 3, 5) and o.dtype == torch.float32
    zero = torch.zeros(3, 8, 5)
    for n in range(2):
        recurrent, _ = gated_delta_rule_recurrent(q[n], k[n], v[n], g[n], beta[n], zero)
        chunked, _ = gated_delta_rule_chunked(q[n], k[n], v[n], g[n], beta[n], zero, chunk_size)
        assert rms_rel_err(o[n], recurrent) < 1e-6, (o[n] - recurrent).abs().max()
        assert rms_rel_err(o[n], chunked) < 1e-6, (o[n] - chunked).abs().max()


def test_chunk_rule_gradcheck_fp64():
    inputs = [t.requires_grad_() for t in rule_inputs(1, 8, 1, 3, 2, seed=1, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *a: chunk_gated_delta_rule(*a, chunk_size=3), inputs)


def test_chunk_rule_gradient_equals_autograd_through_the_recurrence():
    inputs = [t.requires_grad_() for t in rule_inputs(2, 40, 2, 8, 5, seed=2)]
    weight = torch.randn(2, 40, 2, 5, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((chunk_gated_delta_rule(*inputs, chunk_size=16) * weight).sum(), inputs)
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    ref = torch.stack([gated_delta_rule_recurrent(*(t[n] for t in ref_inputs), torch.zeros(2, 8, 5))[0]
                       for n in range(2)])
    want = torch.autograd.grad((ref * weight).sum(), ref_inputs)
    for name, a, b in zip("q k v g beta".split(), got, want):
        assert rms_rel_err(a, b) < 1e-5, (name, (a - b).abs().max())


def test_chunk_rule_stays_fp32_under_bf16_autocast():
    """bf16 inputs under autocast give exactly the fp32 answer on the same (upcast) values."""
    inputs = [t.bfloat16() for t in rule_inputs(2, 50, 2, 8, 5, seed=4)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunk_gated_delta_rule(*inputs, chunk_size=16)
    want = chunk_gated_delta_rule(*(t.float() for t in inputs), chunk_size=16)
    assert got.dtype == torch.float32
    assert rms_rel_err(got, want) < 1e-6  # bf16 matmuls inside would leave errors near 1e-2


# --- the model against the reference ---------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_forward_matches_reference(twins, chunk_size):
    cfg, weights, reference, ids = twins
    model = TrainableTarget.from_canonical(cfg, weights, gdn_chunk_size=chunk_size)
    with torch.no_grad():
        out = model(ids, tap_layers=range(cfg.num_hidden_layers))
    assert out.logits.shape == (2, SEQ_LEN, cfg.vocab_size) and sorted(out.taps) == list(range(cfg.num_hidden_layers))
    for n in range(2):
        want = reference.forward(ids[n])
        assert rms_rel_err(out.logits[n], want.logits) < TOL, (out.logits[n] - want.logits).abs().max()
        assert rms_rel_err(out.hidden[n], want.hidden) < TOL, (out.hidden[n] - want.hidden).abs().max()
        for layer in range(cfg.num_hidden_layers):
            assert rms_rel_err(out.taps[layer][n], want.taps[layer]) < TOL, layer


def test_taps_and_logits_are_optional(twins):
    cfg, weights, _, ids = twins
    model = TrainableTarget.from_canonical(cfg, weights)
    with torch.no_grad():
        out = model(ids[:, :20], tap_layers=[1], return_logits=False)
    assert out.logits is None and list(out.taps) == [1]
    with pytest.raises(RequestError, match="tap_layers"):
        model(ids, tap_layers=[cfg.num_hidden_layers])
    with pytest.raises(RequestError, match="input_ids"):
        model(ids[0])


def test_mtp_matches_reference_fed_pairs_one_by_one():
    """Row p reads (h_p, t_{p+1}) at position p, as the reference head does with its cache growing."""
    cfg = tiny_target_config("tiny-dense")
    weights = tiny_target_weights(cfg, seed=5)
    reference, reference_mtp = ReferenceTarget(cfg, weights), ReferenceMTP(cfg, weights)
    model = TrainableTarget.from_canonical(cfg, weights, gdn_chunk_size=16)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hidden = model(ids, return_logits=False).hidden
        mtp_hidden, mtp_logits = model.mtp_forward(hidden[:, :-1], ids[:, 1:])
    for n in range(2):
        ref_hidden = reference.forward(ids[n]).hidden  # [T, C]
        cache = reference_mtp.new_cache()
        steps = [reference_mtp.forward(ref_hidden[p:p + 1], ids[n, p + 1:p + 2], cache) for p in range(39)]
        want_logits, want_hidden = torch.cat([s.logits for s in steps]), torch.cat([s.hidden for s in steps])
        assert rms_rel_err(mtp_logits[n], want_logits) < TOL, (mtp_logits[n] - want_logits).abs().max()
        assert rms_rel_err(mtp_hidden[n], want_hidden) < TOL


def test_mtp_position_offset_shifts_every_row_alike():
    """RoPE scores depend on position differences only, so one offset for all rows changes nothing."""
    cfg = tiny_target_config("tiny-dense")
    model = TrainableTarget.from_canonical(cfg, tiny_target_weights(cfg, seed=5))
    gen = torch.Generator().manual_seed(8)
    hidden, next_ids = torch.randn(2, 12, cfg.hidden_size, generator=gen), torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        at_zero = model.mtp_forward(hidden, next_ids)[1]
        shifted = model.mtp_forward(hidden, next_ids, position_offset=333)[1]
    assert rms_rel_err(shifted, at_zero) < 1e-5


def test_mtp_absent_or_misshaped_is_refused():
    cfg = tiny_target_config("tiny-dense-text")
    model = TrainableTarget(cfg)
    assert model.mtp is None
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        model.mtp_forward(torch.zeros(1, 3, cfg.hidden_size), torch.zeros(1, 3, dtype=torch.long))
    mtp_model = TrainableTarget(tiny_target_config("tiny-dense"))
    with pytest.raises(RequestError, match="hidden shape"):
        mtp_model.mtp_forward(torch.zeros(1, 4, cfg.hidden_size), torch.zeros(1, 3, dtype=torch.long))


# --- canonical weights, refusals, init -----------------------------------------------------------------


def test_canonical_state_dict_round_trips(twins):
    cfg, weights, _, _ = twins
    model = TrainableTarget.from_canonical(cfg, weights)
    state = model.canonical_state_dict()
    shapes = expected_target_shapes(cfg)
    assert list(state) == list(shapes)
    assert all(tuple(state[name].shape) == shape for name, shape in shapes.items())
    assert all(torch.equal(state[name], weights[name]) for name in shapes)
    if cfg.tie_word_embeddings:
        assert state["lm_head.weight"].data_ptr() == state["embed_tokens.weight"].data_ptr()
    again = TrainableTarget.from_canonical(cfg, state).canonical_state_dict()
    assert all(torch.equal(again[name], state[name]) for name in shapes)


def test_from_canonical_refuses_bad_tensors():
    cfg = tiny_target_config("tiny-dense")
    weights = tiny_target_weights(cfg, seed=0)
    missing = {k: v for k, v in weights.items() if k != "layers.0.linear_attn.A_log"}
    with pytest.raises(CheckpointError, match="layers.0.linear_attn.A_log"):
        TrainableTarget.from_canonical(cfg, missing)
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        TrainableTarget.from_canonical(cfg, {**weights, "mtp.fc.weight": torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match="not canonical"):
        TrainableTarget.from_canonical(cfg, {**weights, "layers.0.extra": torch.zeros(1)})
    tied = tiny_target_config("tiny-dense-text")
    tied_weights = tiny_target_weights(tied, seed=0)
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        TrainableTarget.from_canonical(tied, {**tied_weights, "lm_head.weight": tied_weights["lm_head.weight"] + 1})


def test_moe_config_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="is_moe"):
        TrainableTarget(tiny_target_config("tiny-moe"))


def test_init_weights_is_deterministic_per_seed_and_follows_the_recipe():
    cfg = tiny_target_config("tiny-dense")
    a, b = TrainableTarget(cfg), TrainableTarget(cfg)
    a.init_weights(7)
    b.init_weights(7)
    sa, sb = a.canonical_state_dict(), b.canonical_state_dict()
    assert all(torch.equal(sa[name], sb[name]) for name in sa)
    b.init_weights(8)
    assert not torch.equal(sa["layers.0.linear_attn.in_proj_qkv.weight"], b.canonical_state_dict()[
        "layers.0.linear_attn.in_proj_qkv.weight"])

    assert torch.all(sa["norm.weight"] == 0) and torch.all(sa["mtp.pre_fc_norm_hidden.weight"] == 0)
    assert torch.all(sa["layers.0.linear_attn.norm.weight"] == 1) and torch.all(sa["layers.0.linear_attn.dt_bias"] == 1)
    a_log = torch.cat([sa[f"layers.{i}.linear_attn.A_log"] for i in cfg.linear_attention_layers])
    assert a_log.exp().min() >= 0.01 and a_log.exp().max() <= 16 and a_log.std() > 0.1
    k = cfg.linear_conv_kernel_dim
    assert sa["layers.0.linear_attn.conv1d.weight"].abs().max() <= k ** -0.5
    assert abs(float(sa["embed_tokens.weight"].std()) - 0.02) < 0.002
    residual = torch.cat([sa[f"layers.{i}.mlp.down_proj.weight"].flatten() for i in range(cfg.num_hidden_layers)])
    assert abs(float(residual.std()) - 0.02 / (2 * cfg.num_hidden_layers) ** 0.5) < 0.001


def test_backward_reaches_every_parameter():
    cfg = tiny_target_config("tiny-dense")
    model = TrainableTarget.from_canonical(cfg, tiny_target_weights(cfg, seed=1), gdn_chunk_size=16)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    out = model(ids)
    _, mtp_logits = model.mtp_forward(out.hidden[:, :-1], ids[:, 1:])
    (out.logits.logsumexp(-1).mean() + mtp_logits.logsumexp(-1).mean()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


# --- no host syncs, no loops over tokens -----------------------------------------------------------------


class AtenOps(TorchDispatchMode):
    """Counts every aten op that runs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops_of_step(model: TrainableTarget, steps: int) -> Counter[str]:
    ids = torch.randint(0, model.cfg.vocab_size, (2, steps), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)  # accumulating into existing grads would add ops
    with AtenOps() as mode:
        out = model(ids, tap_layers=[0])
        _, mtp_logits = model.mtp_forward(out.hidden, ids)
        (out.logits.mean() + mtp_logits.mean()).backward()
    return mode.ops


def test_forward_and_backward_have_no_host_sync_and_no_loop_over_tokens():
    """The op count of a training step depends on the number of GDN chunks only, never on T itself."""
    model = TrainableTarget(tiny_target_config("tiny-dense"), gdn_chunk_size=16)
    one_chunk_short, one_chunk_long = _ops_of_step(model, 5), _ops_of_step(model, 13)
    three_chunks = _ops_of_step(model, 40)
    assert one_chunk_short == one_chunk_long
    assert sum(three_chunks.values()) > sum(one_chunk_long.values())  # the chunk loop is there
    syncing = {"aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.equal", "aten.unique"}
    assert not syncing & set(three_chunks), syncing & set(three_chunks)
