#!/usr/bin/env bash
# Run quality rows one at a time, one process each, on one thread:
#   lab/run_rows.sh QUEUE DIR
# Each line of QUEUE is "NAME :: COMMAND" (a `kivi eval ppl|passkey ... --json` command); its
# stdout goes to DIR/NAME.json, its stderr to DIR/NAME.err, and DIR/log.txt gets the lines
# "<date> START NAME :: COMMAND" and "<date> END NAME rc=N" that `python -m lab rotation_table`
# reads. A row whose NAME.json already holds a result is skipped, so a stopped queue resumes.
set -u
queue=$1 dir=$2
mkdir -p "$dir"
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  name=${line%% :: *} cmd=${line#* :: }
  [[ -s "$dir/$name.json" ]] && continue
  echo "$(date -u +%FT%TZ) START $name :: $cmd" >> "$dir/log.txt"
  OMP_NUM_THREADS=1 nice -n 10 bash -c "$cmd" > "$dir/$name.json.part" 2> "$dir/$name.err"
  rc=$?
  [[ $rc == 0 ]] && mv "$dir/$name.json.part" "$dir/$name.json"
  echo "$(date -u +%FT%TZ) END $name rc=$rc" >> "$dir/log.txt"
done < "$queue"
