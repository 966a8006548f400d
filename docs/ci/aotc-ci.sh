#!/usr/bin/env bash
# The aotc steps of the GitHub Actions workflow in this folder, as one script,
# so that CI and a local run (tests/test_ci_workflow.py) run the same commands.
#
#   aotc-ci.sh key      MODEL_DIR            print the build's cache key (for actions/cache)
#   aotc-ci.sh shard    MODEL_DIR I N        compile shard I of N into $AOTC_CACHE_DIR
#   aotc-ci.sh assemble MODEL_DIR OUT        bundle from the cache alone (fails on any miss), then smoke-test it
#
# Build options come from $AOTC_BUILD_ARGS (e.g. "--backend inductor --buckets 1,2,4,8").
set -euo pipefail
cmd=$1; shift
read -r -a args <<< "${AOTC_BUILD_ARGS:-}"
case "$cmd" in
  key)      aotc cache key "$1" "${args[@]}" ;;
  shard)    aotc build "$1" "${args[@]}" --shard "$2/$3" ;;
  assemble) aotc build "$1" "${args[@]}" --require-cache -o "$2"
            aotc run "$2" --model "$1" --check --max-new-tokens 8 --prompt "Hello, world!" ;;
  *)        echo "usage: $0 key|shard|assemble ..." >&2; exit 2 ;;
esac
