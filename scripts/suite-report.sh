# Reading the logs of `cargo test` runs of Burn's test suites, for scripts/burn-suite.sh and
# scripts/burn-module-tests.sh (sourced, not run).

# Prints script $1's `# Usage:` comment block (up to the next bare `#` line) and exits 2.
print_usage() { awk '/^# Usage:/ {p = 1} p && /^#$/ {exit} p' "$1" >&2; exit 2; }

# Prints "$2: test result: N passed; M failed; K ignored" summed over every test binary in log $1.
summary() {
    grep -E "^test result" "$1" | awk -v label="$2" '
        { for (i = 1; i < NF; i++) {
              if ($(i + 1) ~ /^passed/) p += $i
              if ($(i + 1) ~ /^failed/) f += $i
              if ($(i + 1) ~ /^ignored/) g += $i } }
        END { printf "%s: test result: %d passed; %d failed; %d ignored\n", label, p, f, g }'
}

# The names of the tests that failed in log $1, sorted.
failures() { { grep -E "^test .* FAILED$" "$1" || true; } | sed -E 's/^test (.*) \.\.\. FAILED$/\1/' | sort; }

# Reports suite $1 (log $1.log) run on $3; with a baseline log (baseline_$1.log, $2 = 1) it passes
# when the suite fails exactly the tests that the inner backend $4 fails alone. A failure sets
# STATUS=1.
report_suite() {
    local t=$1 baseline=$2 on=$3 alone=$4
    summary "$t.log" "$t, $on"
    if [ "$baseline" = 1 ]; then
        summary "baseline_$t.log" "$t, $alone alone"
        local only fixed
        only=$(comm -23 <(failures "$t.log") <(failures "baseline_$t.log"))
        fixed=$(comm -13 <(failures "$t.log") <(failures "baseline_$t.log"))
        echo "$t tests failing under Collective only: $(echo -n "$only" | grep -c . || true)"
        [ -z "$only" ] || { echo "$only"; STATUS=1; }
        [ -z "$fixed" ] || echo "$t tests failing on $alone alone only: $fixed"
    else
        failures "$t.log"
        [ -z "$(failures "$t.log")" ] || STATUS=1
    fi
    # A build that failed leaves no test result.
    grep -q "^test result" "$t.log" || { echo "$t: no test ran (see $t.log)"; STATUS=1; }
}
