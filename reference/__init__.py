"""dflash2.reference: the executable specification.

Contract: clean, minimal, readable fp32 PyTorch. Every equation of the target (Qwen3.5 hybrid:
Gated DeltaNet + gated full attention, dense or MoE, with its MTP head), of the DFlash 2 draft
and of speculative verification is written here once, in the plainest form that runs. The fast
engine (``dflash2.fast``) specializes it and is held to it by ``conformance/``.

Rules: one concept per file, equations in docstrings, shapes at function boundaries
(``# [T, H, D]``), no hidden global state (randomness is an argument), and no import of
``dflash2.fast`` or Triton.

Packages. ``fast/`` may import ``formats``, ``tiny`` and ``request``, never ``model`` or
``speculative`` (tests/test_layout.py holds that line); the sub-packages mirror ``fast/``'s, so
a concept's reference twin, fast piece and conformance test share a name.

formats/  what both engines load and validate identically (shared)
    config             the target's config.json: parsing, validation, ``TargetConfig``
    weights            the canonical target tensor names and shapes (the loader/model contract)
    checkpoint         target safetensors (flat, wrapper, sharded, fused or per-expert) -> canonical
    tokenizer          loading a folder's tokenizer as both engines do; fit and EOS checks
    chat_template      the ChatML chat template with Qwen3.5's thinking rules
    draft_config       the DFlash 2 draft's config.json: startup validation against the target, k
    draft_checkpoint   the draft's tensor table, validated by name and shape, and its loading
    errors             user-facing errors (config, checkpoint, request), one line each

tiny/  tiny random checkpoints in the real formats, for tests and the demo (shared)
    target             tiny random targets written in the real Qwen3.5 HF format; the presets
    weights            their random canonical weights (scales that keep them non-degenerate) and disk layout
    tokenizer          tokenizer files for tiny checkpoints (small BPE, or the real Qwen3.5 BPE)
    draft              tiny random DFlash 2 drafts in the real format, fitted to a target

request/  the request contract both engines honour (shared)
    rng                keyed randomness: Philox uniforms by (seed, position, purpose, slot)
    sampling_params    per-request sampling parameters and their validation
    stopping           when a request ends (stop ids, stop strings, max_tokens)
    trace              the ``--trace`` record of one verify step

model/  the forwards, fp32 (twins: fast/model/)
    norm               zero-centred RMSNorm and the gated RMSNorm of GDN outputs
    rope               partial NeoX rotary embedding at absolute positions
    delta_rule         the gated delta rule: the recurrent definition and its chunked twin
    gdn                the Gated DeltaNet mixer: causal conv, gates, delta rule; ``GDNState``
    attention          gated full attention over an explicit ``KVCache``
    mlp                the dense SwiGLU MLP
    moe                the routed mixture of experts with its gated shared expert
    layer              one pre-norm residual decoder layer (GDN or attention, MLP or MoE)
    target             the whole model: embedding, layers, final norm, head; taps; ``TargetCache``
    mtp                the multi-token-prediction head (``mtp.*``) and its own cache
    conv               the grouped dynamic causal conv around each draft sublayer
    draft              the DFlash 2 draft forward: context rows, context K/V, the block

speculative/  proposing and verifying (twins: fast/speculative/, fast/kernels/)
    sampling           the target's filtered distribution p and the inverse-CDF draw
    proposer           the ``Proposer`` interface and ``Proposal`` (tokens, candidates, q)
    ring               the per-request DFlash K/V ring: slots, tagged reads, rebuild
    selector           the candidate selector: top-K_sel candidates, edge scores, the walk, q
    dflash             DFlash 2 as a proposer: ring writes on observe, block and walk on propose
    mtp                MTP as a proposer: chained greedy steps, truncation on observe
    ngram              prompt lookup as a proposer (the worked example of writing-a-proposer)
    verify             greedy prefix match and sparse-q rejection, with untrusted-row handling
    loop               the loop for one request: propose, verify, GDN rollback by replay, observe
    prefix             prefix-cache semantics: snapshots of the whole speculative state, restores, the store

generate               plain decoding, the baseline; prompt checks and the first token
runner                 a checkpoint folder to decoding: what ``ft generate --engine reference`` runs

docs/architecture.md has the request lifecycle through both engines; docs/walkthrough.md one step.
"""
