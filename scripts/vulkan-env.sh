# shellcheck shell=bash
# Sourced by scripts/gpu-bench.sh and scripts/gpu-eval.sh: the Vulkan loader
# on an offline GPU machine. NVIDIA's Vulkan driver finds no device with the
# loader alone, so the GL dispatch libraries come with it.

vulkan_debs=(libvulkan1 libglvnd0 libglx0 libegl1 libgl1 libopengl0 libgles2)

# download_vulkan_debs DIR: the Debian packages above (amd64) into DIR, on a
# machine that reaches the Debian package registry.
download_vulkan_debs() {
    local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/sieve-apt-amd64'
    mkdir -p /tmp/sieve-apt-amd64/partial "$1"
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd "$1" && apt-get $o download "${vulkan_debs[@]}")
}

# setup_vulkan [DEB ...]: unpacks the packages (and .gl/*.deb) into / when
# the libraries are missing, falls back to apt-get, and points the loader at
# NVIDIA's manifests where containers put them outside the standard folders.
# Returns 1 when there is still no loader.
setup_vulkan() {
    local debs=("$@") f icd egl
    compgen -G ".gl/*.deb" >/dev/null && debs+=(.gl/*.deb)
    has_libs() { for l in libvulkan.so.1 libGLX.so.0 libEGL.so.1; do ldconfig -p 2>/dev/null | grep -q "$l" || return 1; done; }
    if [ ${#debs[@]} -gt 0 ] && [ -f "${debs[0]}" ] && ! has_libs; then
        for f in "${debs[@]}"; do dpkg -x "$f" /; done
        ldconfig
    fi
    if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get install -y -q libvulkan1 >/dev/null
        fi
        if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
            echo "no Vulkan loader (libvulkan.so.1); install libvulkan1" >&2
            return 1
        fi
    fi
    if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ]; then
        icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
        if [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json >/dev/null 2>&1; then
            export VK_DRIVER_FILES="$icd"
        fi
    fi
    egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    if [ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] && [ -f "$egl" ]; then
        export __EGL_VENDOR_LIBRARY_FILENAMES="$egl"
    fi
    export NODEVICE_SELECT=1
}
