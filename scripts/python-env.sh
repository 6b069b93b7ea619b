#!/usr/bin/env bash
# Makes (or refreshes) a virtual environment with the Python client (clients/python)
# installed from its directory as a user installs it (a built package, so its copy of
# the script is the one tested), pytest, black and mypy. Prints the environment's python.
#   scripts/python-env.sh                 .venv, the newest redis-py
#   scripts/python-env.sh redis==5.0.8    .venv-redis-5.0.8, that redis-py (the oldest
#                                         the package supports, for test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

redis_spec=${1:-redis>=5}
venv=.venv
[ $# -gt 0 ] && venv=.venv-${redis_spec//==/-}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
# fastapi, uvicorn, httpx and flask: for the middleware's tests and the example only
# (the package itself needs none of them); http_sfv: the tests parse the draft's
# RateLimit fields with a real Structured Fields parser.
"$venv/bin/python" -m pip install --quiet "$redis_spec" "pytest>=7" black mypy \
  fastapi uvicorn httpx flask http_sfv >&2
# setuptools keeps build/ between builds: a stale copy of a removed file would be packed.
rm -rf clients/python/build
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps ./clients/python >&2
rm -rf clients/python/build
echo "$PWD/$venv/bin/python"
