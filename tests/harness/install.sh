#!/usr/bin/env bash
# Install the real harness programs the `harness` test tier runs, at pinned versions, into
# .cache/harness/ (npm) and the active Python environment (PyPI). Idempotent: a second run with
# the same pins does nothing. npm 11 does not run dependencies' install scripts unless allowed:
# the two CLIs that need theirs (they link the platform binary) get them run explicitly.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.cache/harness
mkdir -p "$DIR"
PINS='{
  "name": "loongsage-harnesses", "private": true,
  "dependencies": {
    "@anthropic-ai/claude-code": "2.1.197",
    "@openai/codex": "0.171.0",
    "opencode-ai": "1.18.33",
    "@mariozechner/pi-coding-agent": "0.73.1"
  }
}'
if [ "$(cat "$DIR/package.json" 2>/dev/null)" != "$PINS" ] || [ ! -e "$DIR/node_modules/.bin/pi" ]; then
  printf '%s' "$PINS" > "$DIR/package.json"
  npm install --prefix "$DIR" --no-audit --no-fund --ignore-scripts --loglevel=error
  (cd "$DIR/node_modules/@anthropic-ai/claude-code" && node install.cjs)
  (cd "$DIR/node_modules/opencode-ai" && node ./postinstall.mjs)
fi
for b in claude codex opencode pi; do "$DIR/node_modules/.bin/$b" --version >/dev/null; done
python -m pip install -q "mini-swe-agent==2.4.6" "openai-agents==0.24.0"
echo "harnesses installed in $DIR/node_modules/.bin and $(python -c 'import sys; print(sys.prefix)')"
