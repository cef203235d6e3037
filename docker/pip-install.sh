#!/bin/sh
# `pip install` inside an image build. Behind a TLS-intercepting proxy pip needs the proxy's CA:
# pass it as the build secret `pip-ca` (compose: PIP_CA_BUNDLE=/path/to/bundle.crt); it is
# mounted for the one RUN step and never stored in an image layer.
set -eu
if grep -qs "BEGIN CERTIFICATE" /run/secrets/pip-ca; then
    export PIP_CERT=/run/secrets/pip-ca
fi
exec python -m pip install --no-cache-dir --disable-pip-version-check "$@"
