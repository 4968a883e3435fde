"""tvmpipe: run TVM graph-executor bundles as pipelines of GPU stages on Ray.

The subpackages live in top-level folders of the repository (bundle/, executor/, partition/,
cluster/, ...) and are mapped into this namespace by pyproject.toml.
"""

__version__ = "0.1.0"
