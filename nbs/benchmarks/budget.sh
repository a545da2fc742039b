# Sourced by the benchmark scripts: run one `lmbook bench` process per configuration inside the call's time
# budget (the device tool gives a call at most 10 minutes). Needs O (the JSONL file), START and BUDGET.
run() {  # run LIMIT_S ARGS...: one bench process, skipped when the call's budget is nearly spent
  local lim=$1; shift
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 40 )); then echo "SKIP (budget) $*"; return; fi
  (( lim > left )) && lim=$left
  echo "== $* (limit ${lim}s)"
  timeout $lim python3 -c 'from lmbook.bench import main; main()' "$@" --out "$O" 2>&1 | grep -v '^{' | tail -4
}
