#!/usr/bin/env bash
# Prepare what benchmarks/gpu/gpu_check.sh needs on a GPU machine without network (run here, in the repo root):
# wheels for Python 3.12 in .whl/{common,seqcal,peer} and SmolLM2's config and tokenizer in .gpu/tok.
# Both folders are ignored by git (.git/info/exclude) and travel as the device call's `carry`.
set -eu
PIP="${PIP:-.venv/bin/python -m pip}"
PLAT=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  PLAT="$PLAT --platform ${p}_x86_64"
done
get() { local dir=$1; shift; $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLAT -d ".whl/$dir" "$@"; }
# The image has torch, accelerate, safetensors, tokenizers, huggingface_hub, pyarrow, pandas; not these:
get common pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 loguru==0.7.3
get seqcal transformers==5.24.0 compressed-tensors==0.20.0
get peer llmcompressor==0.14.0.1 compressed-tensors==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
mkdir -p .gpu/tok
src=$(.venv/bin/python -c "from seqcal.models import default_model_dir; print(default_model_dir())")
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$src/$f" ] && cp "$src/$f" .gpu/tok/
done
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || printf "/.whl/\n/.gpu/\n" >> .git/info/exclude
du -sh .whl .gpu
