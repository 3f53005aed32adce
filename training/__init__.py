"""Training the oracle's models from the guard's own interaction logs (``intent train ...``).

``data`` builds the datasets (predictor triples, world-model pairs, task-disjoint splits),
``annotate`` labels z, ``train_intention`` fine-tunes and calibrates the intention predictor,
``train_worldmodel`` fine-tunes a causal LM world model / conditional generator, ``serve``
prints or runs the vLLM command. torch and transformers are imported only inside the trainers.
"""
