"""Rewind for the training libraries people already use: ``rewind.integrations.transformers``.

Each module needs its library (an extra: ``pip install 'rewind[hf]'``); importing this package needs none.
"""
