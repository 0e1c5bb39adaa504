"""The request contract both engines honour: sampling parameters and their validation, the keyed
randomness, when a request stops, and the trace record of a verify step."""
