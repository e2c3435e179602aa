#!/usr/bin/env bash
# Installs the CUDA compiler and static runtime (no driver, no math libraries) in a manylinux_2_28 container from NVIDIA's RHEL 8 repository.
#
#   usage: HMOE_CUDA_VERSION=12.8 bash ci/install_cuda.sh      (cibuildwheel's before-all)
#
# Result: /usr/local/cuda -> /usr/local/cuda-MAJOR.MINOR with bin/nvcc, the runtime headers and
# lib64/libcudart_static.a. hmoe links the runtime statically, so nothing from here ends up as a
# shared-library dependency of the wheel; only the driver (libcuda.so.1) is needed at run time.
# Works on x86_64 and aarch64 (NVIDIA calls its server-Arm repository "sbsa").
set -euo pipefail

ver=${HMOE_CUDA_VERSION:?set HMOE_CUDA_VERSION to MAJOR.MINOR, e.g. 12.8 or 13.0}
if [[ ! $ver =~ ^([0-9]+)\.([0-9]+)$ ]]; then
  echo "install_cuda.sh: HMOE_CUDA_VERSION=$ver is not MAJOR.MINOR" >&2
  exit 1
fi
major=${BASH_REMATCH[1]}
minor=${BASH_REMATCH[2]}
suffix=$major-$minor  # package names spell 12.8 as 12-8
case "$(uname -m)" in
  x86_64) repo_arch=x86_64 ;;
  aarch64) repo_arch=sbsa ;;
  *) echo "install_cuda.sh: no CUDA repository for $(uname -m)" >&2; exit 1 ;;
esac
# shellcheck disable=SC1091
. /etc/os-release
if [[ ${VERSION_ID%%.*} != 8 ]]; then
  echo "install_cuda.sh: this uses the RHEL 8 repository; the image is $PRETTY_NAME" >&2
  exit 1
fi

repo=https://developer.download.nvidia.com/compute/cuda/repos/rhel8/$repo_arch
echo "install_cuda.sh: CUDA $ver for $(uname -m) from $repo"
# The .repo file names NVIDIA's signing key; dnf -y imports it and checks every package against it.
curl -fsSL --retry 5 --retry-delay 10 "$repo/cuda-rhel8.repo" -o /etc/yum.repos.d/cuda-rhel8.repo
dnf -q makecache

# nvcc (with ptxas, fatbinary, nvlink), the runtime headers + libcudart_static.a, and headers that
# moved into their own packages over the releases (crt, nvvm in 12.x; cccl; culibos in 13.x).
# Required ones must exist; the others are installed when this release has them.
required=("cuda-nvcc-$suffix" "cuda-cudart-devel-$suffix")
optional=("cuda-crt-$suffix" "cuda-nvvm-$suffix" "cuda-cccl-$suffix" "cuda-culibos-devel-$suffix")
pkgs=()
for p in "${required[@]}" "${optional[@]}"; do
  if dnf -q list "$p" > /dev/null 2>&1; then
    pkgs+=("$p")
  elif [[ " ${required[*]} " == *" $p "* ]]; then
    echo "install_cuda.sh: $p is not in $repo (is CUDA $ver released for RHEL 8 $repo_arch?)" >&2
    exit 1
  fi
done
# No weak dependencies: the image's gcc-toolset is the host compiler; nothing else is wanted.
dnf install -y --setopt=install_weak_deps=False "${pkgs[@]}"
dnf clean all

root=/usr/local/cuda-$major.$minor
for f in bin/nvcc bin/ptxas bin/fatbinary lib64/libcudart_static.a include/cuda_runtime.h \
         include/cuda_bf16.h include/crt/host_defines.h; do
  [[ -e $root/$f ]] || { echo "install_cuda.sh: $root/$f is missing after the install" >&2; exit 1; }
done
ln -sfn "$root" /usr/local/cuda

# Fail here, not an hour into the build: nvcc must accept the host compiler on PATH (the
# gcc-toolset of the image; nvcc refuses GCC versions newer than it supports) and must build both
# a portable target and the Hopper arch-specific one.
echo "host compiler: $(command -v g++) $(g++ -dumpfullversion)"
/usr/local/cuda/bin/nvcc --version | tail -n 2
tmp=$(mktemp -d)
printf '__global__ void hmoe_probe(float *x) { x[threadIdx.x] += 1.0f; }\n' > "$tmp/probe.cu"
/usr/local/cuda/bin/nvcc -c "$tmp/probe.cu" -o "$tmp/probe.o" \
  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a
rm -rf "$tmp"
echo "install_cuda.sh: CUDA $ver ready at /usr/local/cuda"
