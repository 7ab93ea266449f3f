export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 bench/graph_launch.py --gemms 512 2048
timeout 40 python3 bench/graph_launch.py --gemms 2048 --no-reduced-precision
CUBLASLT_WORKSPACE_SIZE=0 timeout 40 python3 bench/graph_launch.py --gemms 2048 | sed 's/^/lt-ws0 /'
CUBLAS_WORKSPACE_CONFIG=:0:0 timeout 40 python3 bench/graph_launch.py --gemms 2048 | sed 's/^/cublas-ws0 /'
