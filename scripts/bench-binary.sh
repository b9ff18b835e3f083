# Sourced by the scripts that run a bench binary under valgrind (`op-instructions.sh`,
# `step-instructions.sh`), from the repository root.
command -v valgrind > /dev/null || { echo "error: valgrind is not installed" >&2; exit 1; }

# The path of bench NAME's binary: GIVEN when not empty, else built by `cargo bench --no-run`.
bench_binary() {
  local name=$1 bin=${2:-}
  if [ -z "$bin" ]; then
    bin=$(cargo bench --locked --bench "$name" --no-run --message-format=json \
      | grep -o "\"executable\":\"[^\"]*/deps/$name-[^\"]*\"" | cut -d'"' -f4 | tail -1)
  fi
  [ -x "$bin" ] || { echo "error: no bench binary at '$bin'" >&2; return 1; }
  echo "$bin"
}
