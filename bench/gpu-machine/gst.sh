# Sourced on the GPU machine after setup.sh, from the folder `GST=1 bench/gpu-machine/pack.sh`
# filled: Debian 12's GStreamer unpacked into /tmp/gst (dpkg -x, nothing installed), and the
# environment that finds it: its libraries, its plugins and its scanner, a registry of its own.
# Then `endurance` (tests/endurance.rs, e.g. VLM_ENDURANCE_* as docs/benchmarks.md says) and
# `gate_scenes` run from /tmp/bin with the plugin registered statically.
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for deb in "$D"/debs/*.deb; do dpkg -x "$deb" /tmp/gst; done
lib=/tmp/gst/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib:$LD_LIBRARY_PATH GST_PLUGIN_SYSTEM_PATH_1_0=$lib/gstreamer-1.0 \
    GST_PLUGIN_SCANNER_1_0=$lib/gstreamer1.0/gstreamer-1.0/gst-plugin-scanner GST_REGISTRY_1_0=/tmp/gst-registry.bin
for b in endurance gate_scenes; do
    ldd "/tmp/bin/$b" | grep "not found" && echo "[gst] /tmp/bin/$b misses the libraries above"
done
echo "[gst] $(ls "$GST_PLUGIN_SYSTEM_PATH_1_0" | wc -l) plugins in $GST_PLUGIN_SYSTEM_PATH_1_0"
