"""The market bench: price laws, the worker replayed, the online optimum; see ``__main__``."""
