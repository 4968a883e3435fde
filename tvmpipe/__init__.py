"""tvmpipe: run TVM graph-executor bundles as pipelines of GPU stages on Ray.

The subpackages live in top-level folders of the repository (bundle/, executor/, partition/,
cluster/, ...) and are mapped into this namespace by pyproject.toml.
"""

__version__ = "0.1.0"


def _source_tree_path() -> None:
    """Run from a source tree without installing (the GPU check's fallback, where pytest's
    `pythonpath = ["."]` puts the repository root, and so this folder, first on sys.path): the
    subpackages are the repository's top-level folders, so the root joins this package's path.
    Installed copies (no pyproject.toml beside this folder) are left alone."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "executor")) \
            and root not in __path__:
        __path__.append(root)


_source_tree_path()
