# Sourced by the A/B scripts (bench_ab.sh, load_figures.sh) on the device machine, with $base (another tree) and
# $repo (this one) set: the environment, the carried wheels (.whl/) installed under /tmp/site ($site: the prefix to
# put before a tree's PYTHONPATH), and each tree importable as dflash2 from /tmp/pkg-base and /tmp/pkg-this.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && site=/tmp/site:
fi
link_tree() {  # $1 tree, $2 package root: dflash2.<pkg> -> the tree's folders
  mkdir -p "$2/dflash2"
  for pkg in reference fast bench train models cli; do
    [ -d "$1/$pkg" ] && ln -sfn "$1/$pkg" "$2/dflash2/$pkg"
  done
  # a base tree archived without models/ (the weights would push a call past its 64 MiB) shares this tree's
  [ -d "$1/models" ] || ln -sfn "$repo/models" "$2/dflash2/models"
}
link_tree "$base" /tmp/pkg-base
link_tree "$repo" /tmp/pkg-this
