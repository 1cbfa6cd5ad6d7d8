#!/usr/bin/env bash
# Make the secrets the deployment reads, once, into DIR (git ignores both usual places):
#   deploy/make-secrets.sh deploy/secrets              # for docker compose
#   deploy/make-secrets.sh deploy/k8s/base/secrets     # for kubectl apply -k (secretGenerator)
#
#   DIR/api_keys                      one random API key (add more, one per line), and the
#                                     metrics key below
#   DIR/metrics_api_key               Prometheus' key for /metrics (compose only): the gateway
#                                     wants a key there whenever API keys are set
#   DIR/grafana_admin_password        Grafana's admin password (compose only)
#   DIR/link/gateway.key_secret       the gateway's CURVE secret key
#   DIR/link/gateway.key              its public key, given to the workers
#   DIR/link/worker.key_secret        the workers' CURVE secret key
#   DIR/link/authorized/worker.key    its public key: the gateway admits workers holding it
#
# Keys come from `kestrel-keygen NAME --dir DIR` where it is installed, else from pyzmq's
# zmq.auth.create_certificates (the same ZeroMQ certificate format). Existing files are kept.
# DIR is 0700; the files are 0644 (link/authorized 0755) because compose bind-mounts them into containers whose user
# (uid 10001) is not the host user: the folder's mode is what keeps other host users out.
set -euo pipefail
dir="${1:?usage: make-secrets.sh DIR}"
# Python with pyzmq: $PYTHON, else the project's own virtualenv (`make install` made it), else
# python3 (which then needs pyzmq installed).
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then python="$PYTHON"
elif [ -x "$here/.venv/bin/python" ]; then python="$here/.venv/bin/python"
else python=python3; fi
if ! "$python" -c 'import zmq' 2>/dev/null && ! command -v kestrel-keygen >/dev/null 2>&1; then
  echo "make-secrets.sh: $python has no pyzmq; run 'make install' first or set PYTHON" >&2
  exit 2
fi
umask 077
mkdir -p "$dir/link/authorized"
chmod 0700 "$dir"

random_token() { "$python" -c 'import secrets; print(secrets.token_urlsafe(32))'; }

keypair() {  # NAME: writes $dir/link/NAME.key and NAME.key_secret
  if [ -e "$dir/link/$1.key_secret" ]; then return; fi
  if command -v kestrel-keygen >/dev/null 2>&1; then
    kestrel-keygen "$1" --dir "$dir/link"
  else
    "$python" -c 'import sys, zmq.auth; zmq.auth.create_certificates(sys.argv[1], sys.argv[2])' \
      "$dir/link" "$1"
  fi
}

[ -e "$dir/api_keys" ] || { printf 'sk-kestrel-%s\n' "$(random_token)" > "$dir/api_keys"; }
if [ ! -e "$dir/metrics_api_key" ]; then  # its own line in api_keys, so it can be revoked alone
  printf 'sk-kestrel-metrics-%s\n' "$(random_token)" > "$dir/metrics_api_key"
  cat "$dir/metrics_api_key" >> "$dir/api_keys"
fi
[ -e "$dir/grafana_admin_password" ] || random_token > "$dir/grafana_admin_password"
keypair gateway
keypair worker
[ -e "$dir/link/worker.key" ] && mv "$dir/link/worker.key" "$dir/link/authorized/worker.key"
find "$dir" -type f -exec chmod 0644 {} +
chmod 0755 "$dir/link/authorized"  # a bind-mounted folder: the container user must list it
echo "secrets in $dir (API key: $dir/api_keys)"
