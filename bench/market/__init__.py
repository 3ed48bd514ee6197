"""The market bench: price laws, the worker replayed, the stopping reference; see ``__main__``."""
