# Source from the repository root on the device: unpacks the carried quack-kernels site
# (.peers/quack/site.tar.xz, see gated_mlp_check.sh for how it is made) and puts it on PYTHONPATH.
site=/tmp/quack_site
if [ ! -d "$site/site" ]; then
    mkdir -p "$site" && tar -xJf .peers/quack/site.tar.xz -C "$site" || return 1
fi
# flash-attn-4 (pure Python; a wheel is a zip) into the same site, when carried (.peers/flash)
for whl in .peers/flash/flash_attn_4-*.whl; do
    [ -f "$whl" ] && [ ! -d "$site/site/flash_attn" ] && python -m zipfile -e "$whl" "$site/site"
done
# (the .pth file that puts cutlass on the path is not read from PYTHONPATH: named here)
export PYTHONPATH="$PWD:$site/site:$site/site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
# cuda-bindings, which cutlass-dsl needs, is in the device image (KINDS.md's package list): not carried
python -c "import quack, cutlass; print('quack', quack.__version__, 'cutlass-dsl', cutlass.__version__)" 2>&1 | tail -2
python -c "import flash_attn.cute.interface; print('flash-attn-4 importable')" 2>&1 | tail -1
