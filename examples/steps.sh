# Shared by examples/demo.sh and examples/demo_llm.sh (source it after setting D).
step() {  # step NAME CMD...: run, time and log one pipeline step into $D/timings.tsv
  local name=$1; shift
  echo -e "\n=== $name: $*" >&2
  local t0=$EPOCHREALTIME rc=0
  "$@" || rc=$?
  # Exit 3 = done, but some records were rejected or some turns fell back (the extractive baseline
  # rejects small trees; a small model's turns fall back). The chain goes on; any other code stops it.
  if [ "$rc" -eq 3 ]; then echo "($name: some records rejected or fell back; see its rejects file / trace)" >&2
  elif [ "$rc" -ne 0 ]; then exit "$rc"; fi
  awk -v n="$name" -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{printf "%s\t%.1f\n", n, b-a}' >> "$D/timings.tsv"
}
