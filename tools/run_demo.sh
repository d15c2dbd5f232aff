#!/usr/bin/env bash
# Starts the server, streams one answer through grpcurl and one through the
# Python client, then keeps serving until Ctrl-C (DEMO_ONLY=1 stops after the demo).
set -euo pipefail
LISTEN=${LISTEN:-127.0.0.1:50051}
log=$(mktemp)
tokenspout serve --listen "$LISTEN" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 120); do
  grep -q "tokenspout serving" "$log" && break
  kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.5
done
cat "$log"

echo
echo "== grpcurl (server reflection, no .proto files) =="
grpcurl -plaintext "$LISTEN" list
grpcurl -plaintext -d '{"chat": {"messages": [{"role": "user", "content": "Name three colours."}]},
                       "sampling": {"temperature": 0}, "stopping": {"max_new_tokens": 24}}' \
  "$LISTEN" tokenspout.v1.GenerationService/GenerateStream | grep '"text"'

echo
echo "== Python client (tokenspout-client, clients/python) =="
tokenspout-client --address "$LISTEN" stream --chat "Why is the sky blue? Answer in two sentences."

if [[ "${DEMO_ONLY:-0}" == 1 ]]; then exit 0; fi
echo
echo "Serving on $LISTEN; press Ctrl-C to stop."
wait $server
