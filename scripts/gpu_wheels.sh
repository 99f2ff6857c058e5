#!/usr/bin/env bash
# Builds .whl/ (git-ignored): ptops' own wheel and the wheels the GPU machine's image lacks (py3.12,
# manylinux x86_64), at the versions of constraints.txt, for scripts/gpu_check.sh to install there into
# a target folder (never over the image's torch). The image has torch 2.11 CUDA, transformers 5.17,
# accelerate, numpy, pyarrow, prometheus-client, nvidia-ml-py, psutil, pyyaml, ...; it has no trl,
# datasets, pydantic, py-spy, and older transformers/tokenizers than the [trl] extra needs.
# What travels is capped at 64 MiB (repository + carried paths): the wheelhouse must stay <= 40 MiB.
#   bash scripts/gpu_wheels.sh             build .whl/ (needs the package registry)
#   bash scripts/gpu_wheels.sh --dry-run   print what it would fetch (NAME==VERSION), fetch nothing
#   bash scripts/gpu_wheels.sh --check DIR the size check alone
# Then, on the GPU machine, in ONE call of the device tool (see bench/README.md "GPU check"):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}
# constraints.txt names; each is fetched without its dependencies (the image has the rest)
CARRY=(pydantic pydantic_core annotated-types typing-inspection typing_extensions tomli_w py-spy
       typer click rich trl datasets dill multiprocess transformers tokenizers peft)

size_check() {  # DIR: the apparent size of its files against MAX_MIB
  local bytes
  bytes=$(find "$1" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')
  local mib=$((bytes / 1048576))
  if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
    echo "gpu_wheels: $1 holds ${mib} MiB, over the ${MAX_MIB} MiB cap (64 MiB travel in all)" >&2
    return 1
  fi
  echo "gpu_wheels: $1 holds ${mib} MiB (cap ${MAX_MIB} MiB)"
}

pins() {  # NAME==VERSION from constraints.txt for each of CARRY, or an error naming the missing one
  local n v
  for n in "${CARRY[@]}"; do
    v=$(grep -i -E "^${n//[-_]/[-_]}==" constraints.txt | head -1 | cut -d= -f3)
    [ -n "$v" ] || { echo "gpu_wheels: $n has no pin in constraints.txt" >&2; return 1; }
    echo "$n==$v"
  done
}

case "${1:-}" in
  --check) size_check "${2:?--check DIR}"; exit $? ;;
  --dry-run) pins; echo "ptops (this checkout: pip wheel --no-deps .)"; exit 0 ;;
esac

mapfile -t WANT < <(pins)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip wheel -q --no-deps -w .whl . >/dev/null
plats=()
for t in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  plats+=(--platform "${t}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d .whl "${WANT[@]}" 2>&1 | { grep -v "is ignored: it is neither" || true; }
ls -1 .whl
size_check .whl
