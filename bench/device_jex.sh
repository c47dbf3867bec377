# The checkout's `jex` namespace on a machine without `make setup` (the GPU device): `jex.engine` is the
# folder engine/, `jex.tasks` tasks/ and so on (pyproject's package-dir), so a link tree stands in for
# the editable install. From the repository root, after `source /tmp/stage/env.sh`:
#     source bench/device_jex.sh
# then run the benches as `python3 bench/X.py ...` (not `python3 -m jex` from the root: the root's
# bare jex/ would come first on sys.path).
mkdir -p /tmp/jexpkg/jex
for f in "$PWD"/jex/*; do ln -sfn "$f" /tmp/jexpkg/jex/; done
for room in engine tasks lab flows infra overlays deployments; do ln -sfn "$PWD/$room" "/tmp/jexpkg/jex/$room"; done
export PYTHONPATH="/tmp/site4:/tmp/jexpkg:${PYTHONPATH:-}:/tmp/site2:/tmp/site3"  # site4: the stack lock's pins
