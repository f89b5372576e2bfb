#!/bin/bash
# One lease: the Triton kernels' parity tests on CUDA, and the shipped models' translations on CUDA.
# Prepared here before the lease (.gpu/ is in .git/info/exclude and travels as `carry`):
#   mkdir -p .gpu/site/HanTa; cp .venv/lib/python3.11/site-packages/HanTa/{__init__.py,HanoverTagger.py,morphmodel_ger.pgz} .gpu/site/HanTa/
#   zcat ../shared/data/multi30k/test_2016_flickr.de.gz > .gpu/test_2016_flickr.de
# Run there as `bash .gpu/run.sh` with $OUT set; the CPU outputs it is compared with are made here by
#   python -m training.translate --checkpoint models/M --threads 2 --device cpu < .gpu/test_2016_flickr.de
export PYTHONPATH=$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1
{ date; nvidia-smi -L; nproc
  python3 -c "import torch, triton, numba, numpy, onnxruntime as o; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'onnxruntime', o.__version__, o.get_available_providers())"
} > $OUT/env.txt 2>&1
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py -ra > $OUT/test_kernels.log 2>&1
echo "pytest rc $?" >> $OUT/test_kernels.log
tail -3 $OUT/test_kernels.log
for m in multi30k-de-en multi30k-de-en-vanilla; do
  for path in triton reference triton-warm; do  # the warm run finds Numba's and Triton's caches filled
    ref=0; [ $path = reference ] && ref=1
    s=$(date +%s.%N)
    KERNELS_REFERENCE=$ref timeout 90 python3 -m training.translate --checkpoint models/$m --threads 16 --device cuda \
      < .gpu/test_2016_flickr.de > /tmp/$m-cuda-$path.txt 2>> $OUT/translate.log
    rc=$?; e=$(date +%s.%N)
    echo "$m cuda $path rc $rc wall $(python3 -c "print(round($e-$s,2))") s lines $(wc -l < /tmp/$m-cuda-$path.txt)" | tee -a $OUT/translate.log
  done
  cp /tmp/$m-cuda-triton.txt /tmp/$m-cuda-reference.txt $OUT/
  cmp /tmp/$m-cuda-triton.txt /tmp/$m-cuda-triton-warm.txt && echo "$m: warm run identical" | tee -a $OUT/translate.log
done
