"""The `gguf` package (llama.cpp's GGUF reader), imported on first use so that nothing imports it
before a GGUF file is read: the weights loader and the tokenizer both read GGUF files through it."""


class GGUFPackageMissing(ImportError):
    """A GGUF file was to be read and the gguf package is not installed."""


def gguf_package():
    """The gguf package; GGUFPackageMissing, in one line, where it is not installed."""
    try:
        import gguf
    except ModuleNotFoundError as e:
        if e.name != "gguf":  # the package is there, one of its own imports failed: show that
            raise
        raise GGUFPackageMissing("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf
