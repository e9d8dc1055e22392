# Sourced by the device-run scripts: stages under one time budget. Needs START (the run's
# start, `date +%s`), BUDGET_S and OUT set by the script that sources it.
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
run() {  # run NAME MAX_S CMD...: under min(MAX_S, what is left); skipped below 20 s left
  local name=$1 max=$2; shift 2
  local t; t=$(left); [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt 20 ]; then echo "$name: skipped ($(left) s left)"; return 1; fi
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ($(($(date +%s) - START)) s elapsed)"; return $rc
}
