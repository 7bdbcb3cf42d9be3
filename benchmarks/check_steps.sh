# Step bookkeeping shared by the GPU check scripts (sourced; $SUMMARY names the summary file): `step NAME`
# heads a step, `status RC` records how it ended, `end_steps` closes the summary and returns nonzero,
# naming each failed step, where any failed.
failed=()
step() { CURRENT="$*"; echo "== $(date +%T) $*" | tee -a "$SUMMARY"; }
status() { echo "exit $1" | tee -a "$SUMMARY"; [ "$1" = 0 ] || failed+=("$CURRENT (exit $1)"); }
end_steps() {
  step "done"
  if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" | tee -a "$SUMMARY"
    return 1
  fi
}
