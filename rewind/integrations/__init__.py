"""Rewind for the training libraries people already use: ``rewind.integrations.transformers``,
``rewind.integrations.lightning``.

Each module needs its library (an extra: ``pip install 'rewind[hf]'``, ``'rewind[lightning]'``); importing
this package needs none.
"""
