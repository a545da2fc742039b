# The one preamble of the scripts in nbs/benchmarks/, sourced first, from the repo root:
#   needs='bitsandbytes peft'; source nbs/benchmarks/arms.sh     (needs: the Python modules a script needs besides
#                                                                 lmbook's training stack; none: leave it unset)
# A GPU machine has torch (some also transformers and peft) but no package index: what else a script needs comes as
# wheels in .whl/ (or $LMBOOK_WHEELS), which `bash .ci/gpu-wheels` fills where an index is reachable; carry it along.
# The preamble makes $tmp, a scratch folder (the wheels' install, tokens the arms share), removed however the script
# ends, its background jobs (the arms) stopped first; installs there the wheels whose package this Python lacks (never
# one over a package it has); checks that the packages of lmbook's training stack and each of $needs are there, else
# stops with one line naming what is missing, then that they import; and sets the environment the runs share.
# BENCH_SETUP_ONLY=1 stops after the first check (exit 0): what tests/test_bench_setup.py runs for every script on a
# bare Python. A .py script runs the same way through run.sh:
#   bash nbs/benchmarks/run.sh python3 nbs/benchmarks/end_to_end.py ...
set -e
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait; rm -rf "$tmp"' EXIT  # removed however it ends, arms stopped first
trap 'exit 130' INT; trap 'exit 143' TERM  # on a signal, the running command ends first, then the line above runs
mapfile -t _lack < <(python3 - "${LMBOOK_WHEELS:-.whl}" <<'PY'
import importlib.metadata as m, pathlib, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob('*.whl')):
    try: m.version(w.name.split('-')[0])  # the distribution's name, as the wheel's file name gives it
    except m.PackageNotFoundError: print(w)
PY
)
if [ ${#_lack[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "${_lack[@]}"
  echo "installed for this script: $(printf '%s\n' "${_lack[@]}" | xargs -n1 basename | cut -d- -f1 | tr '\n' ' ')"
fi
export PYTHONPATH="$tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# what lmbook's training stack imports (tests/test_bench_setup.py imports it on a bare Python to keep this list whole)
lmbook_needs='torch numpy yaml tokenizers safetensors fastcore'
python3 - $lmbook_needs ${needs:-} <<'PY' || exit 1  # there, as a package index would have put them: quick, no import
import importlib.util, sys
if missing := [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]:
    sys.exit(f"error: no {', '.join(missing)} for this Python, and no wheel of it in the wheels folder: run "
             "`bash .ci/gpu-wheels` where a package index is reachable and carry .whl/ along")
PY
if [ "${BENCH_SETUP_ONLY:-}" = 1 ]; then echo "setup ok: lmbook's packages${needs:+ and $needs} are there"; exit 0; fi
python3 - ${needs:-} <<'PY' || exit 1  # and they import (a wheel of the wrong build would not)
import importlib, sys
for mod in ['lmbook.train.trainer', 'lmbook.train.finetune', 'lmbook.train.bench', *sys.argv[1:]]:
    try: importlib.import_module(mod)
    except ImportError as e: sys.exit(f"error: {mod} cannot be imported ({e}): check the wheels in .whl/")
PY
