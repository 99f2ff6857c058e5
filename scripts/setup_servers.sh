#!/usr/bin/env bash
# Installs the real servers the observability tests start: Prometheus 2.42 (with promtool) and
# Alertmanager 0.25 from Debian. Idempotent and quiet: does nothing when both are present.
# Nothing is started or enabled here; the tests start them on 127.0.0.1 themselves.
# Usage: bash scripts/setup_servers.sh          (needs root or sudo for apt-get)
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }
if have prometheus && have promtool && { have prometheus-alertmanager || have alertmanager; }; then
  exit 0
fi
if ! have apt-get; then
  echo "setup_servers: apt-get not found; install prometheus, promtool and alertmanager yourself" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  have sudo || { echo "setup_servers: need root (or sudo) to apt-get install prometheus" >&2; exit 1; }
  SUDO="sudo"
fi
echo "setup_servers: installing prometheus and prometheus-alertmanager (Debian, ~30 s)" >&2
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d-less containers try to start the services: harmless, they are not needed running
if ! $SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager >/tmp/ptops-setup-servers.log 2>&1; then
  $SUDO apt-get update -qq >>/tmp/ptops-setup-servers.log 2>&1
  $SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager >>/tmp/ptops-setup-servers.log 2>&1 \
    || { echo "setup_servers: apt-get install failed; see /tmp/ptops-setup-servers.log" >&2; exit 1; }
fi
# the Debian packages' services are not needed (tests run their own on loopback); stop them if init started them
if have systemctl && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus prometheus-alertmanager prometheus-node-exporter >/dev/null 2>&1 || true
fi
have prometheus && have promtool || { echo "setup_servers: prometheus/promtool still missing" >&2; exit 1; }
echo "setup_servers: $(prometheus --version 2>&1 | head -1)" >&2
