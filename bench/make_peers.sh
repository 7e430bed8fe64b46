#!/usr/bin/env bash
# The routers bench/router.py measures ours against, each in a venv of its own under
# bench/.venvs/ (ignored by git): never dependencies of modelfleet. Safe to run again.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venvs="$here/.venvs"
mkdir -p "$venvs"

make_venv() {  # name, pip requirement
    local name="$1" requirement="$2"
    if [ -x "$venvs/$name/bin/python" ] && "$venvs/$name/bin/pip" show -q "${requirement%%[=\[]*}" 2>/dev/null; then
        return
    fi
    python3 -m venv "$venvs/$name"
    "$venvs/$name/bin/pip" install -q --disable-pip-version-check "$requirement"
}

make_venv vllm-router "vllm-router==0.1.17"
make_venv litellm "litellm[proxy]==1.108.7"
echo "peers ready in $venvs"
