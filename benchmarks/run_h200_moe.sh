set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 2 -rfE tests/moe/test_moe_kernels_gpu.py tests/moe/test_moe_shared_fusion.py tests/kernels/test_deepgemm_backend.py tests/moe/test_moe_kernels_sm90.py > $OUT/moe_tests.log 2>&1; echo "tests rc=$?"; tail -5 $OUT/moe_tests.log
for t in 1 4 16 64 256 1024 4096; do timeout -k 5 80 python3 -m dsv3serve.bench.kernels.moe_tune --dtype fp8 --shared --quick --tokens $t --out /tmp/tune257 --merge > /tmp/t257_$t.log 2>&1; echo "tune257 t=$t rc=$?"; done
cp /tmp/tune257/*.json $OUT/table_e257.json
timeout -k 5 150 python3 -m dsv3serve.cli bench kernels --only moe --json $OUT/moe.json --write-shared-fusion $OUT/shared_fusion.json > $OUT/moe_bench.log 2>&1; echo "bench rc=$?"; tail -30 $OUT/moe_bench.log
