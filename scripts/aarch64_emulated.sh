#!/usr/bin/env bash
# The Aurora parity checks on aarch64 (the host CPU of Ascend servers), under qemu user-mode emulation on an
# x86-64 Debian 12 machine, judged against the committed baselines (recorded on x86-64, Intel Xeon).
#
# What it proves: a baseline recorded on x86-64 passes on aarch64 CPU kernels — torch 2.14.1's aarch64 wheel
# from the package index (the CUDA build, manylinux_2_28_aarch64: NVPL BLAS for fp32 GEMM, oneDNN 3.12 + ACL,
# no GPU used), Python 3.11 from Debian's arm64 packages, every instruction executed by qemu-aarch64 7.2.
# Each emulated CPU model (QEMU_CPUS) is a separate run:
#   neoverse-n1  ARMv8.2 without SVE and without BF16 (the closest qemu model to Kunpeng 920 / TaiShan v110):
#                bf16 matmuls fall back from oneDNN to torch's BLAS path (torch warns "mkldnn_matmul bf16
#                path needs a cpu with bf16 support"), bf16 convolutions take ATen's own kernels;
#   max          qemu's default (SVE 512-bit, SVE2, BF16, I8MM, SME): bf16 matmuls run in oneDNN
#                (brg:sve_512, ACL gemm), bf16 convolutions in ACL's indirect_gemm; torch's CPU capability
#                stays DEFAULT (its SVE256 kernels are picked for a 256-bit vector length only).
# fp32 GEMM takes NVPL BLAS on both. The emulator models no particular core beyond its ISA (it computes each
# floating-point instruction's IEEE result in software), so what differs from x86 is which kernels and which
# summation orders run — which is what a baseline has to survive.
#
# Measured on a shared 2-core x86-64 box (Debian 12, qemu-user-static 7.2.22), all passing: setup about
# 2 minutes (debootstrap 23 s, about 6 GB of aarch64 wheels 91 s); `import torch` 21 s emulated; the
# training-step checks (test_train_step.py, fp32 and bf16) 77 s to 3 min wall per CPU model depending on
# the load (native x86: 14 s). This script: 4 min 37 s from an empty sysroot and wheel folder with
# QEMU_CPUS=neoverse-n1 (the apt packages already installed), 3 min 25 s for both models with the setup
# in place. Under `max` that bf16 step runs 432 oneDNN matmuls (292 brg:sve_512, 108 ACL gemm, 32 jit
# bf16 gemm; ONEDNN_VERBOSE=1), under neoverse-n1 none. SELECTION=parity_suites/aurora/test_trainer.py
# (the Trainer check of the tiny model, single process; its DeepSpeed variant skips) passes too, about
# 2 min 8 s per CPU model.
# SELECTION='parity_suites/aurora/test_submodules.py -k ...' runs submodule checks of the full model: 16 of
# them (fp32 and bf16 of attention_self_causal, ffn, encoder_layer_0[_train], decoder_layer_0[_train],
# patch_embedding_eval_24, predict_head_eval_24) took 18 min 40 s on neoverse-n1, 17 min 20 s of it the
# session fixture (one fp32 forward of the full seeded model, ViT included, to capture the inputs; 79 s
# natively): emulated fp32 GEMM is the slow part.
#
# Usage (root, Debian 12 x86-64; network to the Debian archive and the package index only):
#   scripts/aarch64_emulated.sh                        # training-step checks on neoverse-n1, then max
#   QEMU_CPUS=neoverse-n1 SELECTION='parity_suites/aurora/test_submodules.py -k "ffn or decoder_layer_0"' \
#     scripts/aarch64_emulated.sh
# Reports (summary.md, results.csv …) go to $REPORT_DIR/<cpu model>.
#
# Why no binfmt_misc: containers rarely have it, so the emulator is called explicitly with -L (the sysroot).
# Child processes Python spawns would then run natively and fail: run without xdist, and only tests that
# spawn none (the distributed checks do).
#
# Why the fake /proc/cpuinfo: qemu 7.2 shows the guest the x86 host's /proc/cpuinfo, and pytorch's cpuinfo
# library crashes on it (SIGSEGV in cpuinfo_arm_linux_init during `import torch`). qemu's -L prefix also
# redirects any absolute path that exists under the sysroot, so the script writes an aarch64 /proc/cpuinfo
# (and /sys/devices/system/cpu/{possible,present,online,cpuN/regs/identification/midr_el1}) there, built
# under emulation from the emulated CPU's own MIDR_EL1 and hwcaps — rewritten before each CPU model's run.
set -euo pipefail

ROOT=${ARM64_ROOT:-/opt/arm64root}          # arm64 userland (sysroot)
SITE=${ARM64_SITE:-/opt/arm64site}          # aarch64 wheels, installed from x86 by pip --platform
QEMU_CPUS=${QEMU_CPUS:-"neoverse-n1 max"}
SELECTION=${SELECTION:-parity_suites/aurora/test_train_step.py}
REPORT_DIR=${REPORT_DIR:-/tmp/aarch64-parity}
# The Debian archive this machine's apt already uses (its first URIs / deb line), unless MIRROR is given.
apt_mirror() {
  { grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -h '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}'; } | head -n 1
}
MIRROR=${MIRROR:-$(apt_mirror)}
[ -n "$MIRROR" ] || { echo "no Debian archive found in /etc/apt: set MIRROR to one" >&2; exit 2; }
NCPU=$(nproc)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# 1. The emulator, debootstrap, and pip and GNU time for the x86 side (Debian packages).
if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null \
        || ! python3.11 -m pip --version >/dev/null 2>&1 || [ ! -x /usr/bin/time ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y qemu-user-static debootstrap python3-pip time
fi
qemu-aarch64-static --version | head -1

# 2. An arm64 userland with Python 3.11. The --foreign first stage only unpacks the base packages; the extra
#    ones are left as .deb in var/cache/apt/archives: unpack them all (no maintainer scripts are needed for a
#    sysroot).
if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
    debootstrap --foreign --arch=arm64 --variant=minbase \
        --include=python3.11,python3.11-venv,libpython3.11,ca-certificates bookworm "$ROOT" "$MIRROR"
    for deb in "$ROOT"/var/cache/apt/archives/*.deb; do dpkg -x "$deb" "$ROOT"; done
fi
PY=(qemu-aarch64-static -L "$ROOT" "$ROOT/usr/bin/python3.11")

# 3. The aarch64 wheels, installed from x86 (no emulation): the versions of the x86 environment the baselines
#    were checked with. pip matches --platform tags exactly, so every manylinux glibc level up to bookworm's
#    2.36 is listed (the CUDA libraries torch's aarch64 wheel depends on are tagged 2_17 … 2_28).
if [ ! -d "$SITE/torch" ]; then
    plat=(--platform manylinux2014_aarch64)
    for v in $(seq 17 36); do plat+=(--platform "manylinux_2_${v}_aarch64"); done
    python3.11 -m pip install --no-cache-dir --target "$SITE" "${plat[@]}" --only-binary=:all: \
        --python-version 3.11 --implementation cp \
        torch==2.14.1 torchvision==0.29.1 numpy==2.4.6 pandas==3.1.1 pytest==9.2.0 hypothesis==6.170.27 \
        safetensors==0.8.0 filelock==4.3.2 aurora-model==0.2.0 transformers==4.57.6 einops==0.8.2 \
        scipy==1.17.1 statsmodels==0.15.0 accelerate==1.16.0 scikit-learn==1.9.1 huggingface_hub==0.36.2 \
        tokenizers==0.22.2 pyarrow==26.0.1 matplotlib==3.11.2
fi
# The plugin itself (its pytest11 entry point), without dependencies, from a clean copy of this checkout.
src=$(mktemp -d)
git -C "$REPO" archive HEAD | tar -x -C "$src"
python3.11 -m pip install --no-cache-dir --no-deps --upgrade --target "$SITE" "$src"
rm -rf "$src"

# 4. Per emulated CPU model: the fake /proc/cpuinfo and sysfs, what torch sees, then the checks.
cpuinfo_py=$(mktemp --suffix=.py)
cat > "$cpuinfo_py" <<'EOF'
import ctypes, mmap, os, struct, sys
root, ncpu = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None)
libc.getauxval.restype = ctypes.c_ulong
hw, hw2 = libc.getauxval(16), libc.getauxval(26)          # AT_HWCAP, AT_HWCAP2
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(struct.pack("<II", 0xD5380000, 0xD65F03C0))   # mrs x0, midr_el1; ret
midr = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()
H1 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
      "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg").split()
H2 = ("dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 "
      "i8mm bf16 dgh rng bti mte ecv afp rpres mte3 sme sme_i16i64 sme_f64f64 sme_i8i32 sme_f16f32 "
      "sme_b16f32 sme_f32f32 sme_fa64").split()
feats = " ".join([n for i, n in enumerate(H1) if hw >> i & 1] + [n for i, n in enumerate(H2) if hw2 >> i & 1])
block = ("processor\t: {n}\nBogoMIPS\t: 200.00\nFeatures\t: %s\nCPU implementer\t: 0x%02x\nCPU architecture: 8\n"
         "CPU variant\t: 0x%x\nCPU part\t: 0x%03x\nCPU revision\t: %d\n\n") % (
         feats, midr >> 24 & 0xFF, midr >> 20 & 0xF, midr >> 4 & 0xFFF, midr & 0xF)
os.makedirs(f"{root}/proc", exist_ok=True)
with open(f"{root}/proc/cpuinfo", "w") as f:
    f.write("".join(block.format(n=n) for n in range(ncpu)))
cpu = f"{root}/sys/devices/system/cpu"
for name in ("possible", "present", "online"):
    os.makedirs(cpu, exist_ok=True)
    with open(f"{cpu}/{name}", "w") as f:
        f.write(f"0-{ncpu - 1}\n" if ncpu > 1 else "0\n")
for n in range(ncpu):
    os.makedirs(f"{cpu}/cpu{n}/regs/identification", exist_ok=True)
    with open(f"{cpu}/cpu{n}/regs/identification/midr_el1", "w") as f:
        f.write(f"0x{midr:016x}\n")
print(f"emulated CPU: MIDR_EL1 0x{midr:08x}, hwcaps: {feats}")
EOF

cd "$REPO"
status=0
for cpu in $QEMU_CPUS; do
    echo "=== QEMU_CPU=$cpu"
    export QEMU_CPU=$cpu
    "${PY[@]}" "$cpuinfo_py" "$ROOT" "$NCPU"
    PYTHONPATH=$SITE "${PY[@]}" -c "import platform, torch; print(platform.machine(), torch.__version__, \
'cpu capability', torch.backends.cpu.get_cpu_capability(), 'acl', torch.backends.mkldnn.is_acl_available(), \
'threads', torch.get_num_threads())"
    # shellcheck disable=SC2086  # SELECTION is a list of pytest arguments
    eval "set -- $SELECTION"
    PYTHONPATH=$SITE /usr/bin/time -f "wall %e s, user %U s, max RSS %M KB" "${PY[@]}" -m pytest \
        -p no:cacheprovider -p no:xdist --npu-parity --parity-report "$REPORT_DIR/$cpu" -v -rA "$@" || status=1
done
rm -f "$cpuinfo_py"
exit $status
