# On the GPU machine after setup.sh: llama.cpp's CUDA libraries and llama-server, xz, in parts of
# 15 MiB under $OUT (a machine sends back files of at most 16 MiB). Here, join them as
# .device/cuda-libs.tar.xz (`cat .../cuda-libs.tar.xz.part-* > .device/cuda-libs.tar.xz`): the
# next machine's setup.sh unpacks them instead of building (~350 s).
tar cJf - -C /tmp/cuda/build/bin . | split -b 15M - "$OUT/cuda-libs.tar.xz.part-"
ls -la "$OUT"
