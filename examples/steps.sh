# Shared by examples/demo.sh and examples/demo_llm.sh (source it after setting D).
# CPU seconds (user + sys) of the finished child processes so far, from bash's `times` (run in
# this shell, not a $(...) subshell, whose children are not the pipeline's).
children_cpu() {
  times > "$D/.times"
  tail -1 "$D/.times" | awk '{s = 0; for (i = 1; i <= 2; i++) {split($i, p, /[ms]/); s += 60 * p[1] + p[2]} printf "%.1f", s}'
}

step() {  # step NAME CMD...: run, time and log one pipeline step into $D/timings.tsv (wall) and $D/cpu.tsv
  local name=$1; shift
  echo -e "\n=== $name: $*" >&2
  local t0=$EPOCHREALTIME c0 c1 rc=0
  children_cpu > "$D/.c0"; c0=$(cat "$D/.c0")
  "$@" || rc=$?
  # Exit 3 = done, but some records were rejected or some turns fell back (the extractive baseline
  # rejects small trees; a small model's turns fall back). The chain goes on; any other code stops it.
  if [ "$rc" -eq 3 ]; then echo "($name: some records rejected or fell back; see its rejects file / trace)" >&2
  elif [ "$rc" -ne 0 ]; then exit "$rc"; fi
  awk -v n="$name" -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{printf "%s\t%.1f\n", n, b-a}' >> "$D/timings.tsv"
  children_cpu > "$D/.c0"; c1=$(cat "$D/.c0")
  awk -v n="$name" -v a="$c0" -v b="$c1" 'BEGIN{printf "%s\t%.1f\n", n, b-a}' >> "$D/cpu.tsv"
}
