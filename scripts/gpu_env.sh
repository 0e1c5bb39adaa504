# Sourced by the device-machine scripts (gpu_open_figures.sh, gpu_tp_figures.sh), run from a frozen copy of the tree
# with the carried wheels (scripts/gpu_wheels.sh): installs the wheels into /tmp/site, exposes the tree as the
# dflash2 package under /tmp/pkg, and exports the paths.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pkg/dflash2 && for p in reference fast bench train models cli; do ln -sfn "$PWD/$p" /tmp/pkg/dflash2/$p; done
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
