# Environment shared by the main job and the test run (sourced, not executed).
export PREFECT_LOGGING_LEVEL="${PREFECT_LOGGING_LEVEL:-WARNING}"
# a loaded 2-core machine can take longer than the default 20 s to start Prefect's temporary server
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# keeps Ray on loopback (--node-ip-address=127.0.0.1 alone is not enough)
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Ray 2.60 enables token auth once ~/.ray/auth_token exists; the loopback head runs without it
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
