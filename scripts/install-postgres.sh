#!/usr/bin/env bash
# Install Debian's PostgreSQL server binaries for the PostgreSQL sink's tests and demo.
# Idempotent: does nothing when /usr/lib/postgresql/<version>/bin/initdb already exists.
# Snapline starts its own throwaway servers (connectors/local/postgres.py), so the package's
# default cluster is not needed and is not created.
set -euo pipefail

if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    echo "PostgreSQL server binaries present: $(ls -d /usr/lib/postgresql/*/bin | tr '\n' ' ')"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "install-postgres.sh: need root or sudo to apt-get install postgresql" >&2
        exit 1
    fi
    SUDO="sudo"
fi

# Keep the package from creating and starting a 'main' cluster on port 5432.
if [ ! -e /etc/postgresql-common/createcluster.conf ]; then
    $SUDO mkdir -p /etc/postgresql-common
    echo "create_main_cluster = false" | $SUDO tee /etc/postgresql-common/createcluster.conf >/dev/null
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold postgresql

if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    echo "install-postgres.sh: postgresql installed but no /usr/lib/postgresql/*/bin/initdb" >&2
    exit 1
fi
echo "PostgreSQL server binaries installed: $(ls -d /usr/lib/postgresql/*/bin | tr '\n' ' ')"
