# Sourced from the repository root by the device check scripts (step_levers.sh, fusion_check.sh,
# step_diagnosis.sh): where records go ($out: $OUT on the device, else benchmarks/results), this run's time
# stamp, the carried Hopper kernels on the path (quack_env.sh), and the timed runs' compile settings.
out="${OUT:-benchmarks/results}"
stamp="$(date -u +%Y%m%d_%H%M)"
. benchmarks/quack_env.sh || return 1
export PARATRON_COORDINATE_DESCENT=0 PYTHONUNBUFFERED=1
