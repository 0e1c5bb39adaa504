# Sourced by scripts/gguf_golden.sh and scripts/gguf_oracle.sh: sets LLAMA to the llama.cpp tree vendored in the
# llama-cpp-python $VERSION source distribution, downloaded into $WORK unless LLAMA_CPP_SDIST names an extracted one.
if [[ -z "${LLAMA_CPP_SDIST:-}" ]]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$WORK/sdist"
    tar -xzf "$WORK/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$WORK/sdist"
    LLAMA_CPP_SDIST="$WORK/sdist/llama_cpp_python-$VERSION"
fi
LLAMA="$LLAMA_CPP_SDIST/vendor/llama.cpp"
