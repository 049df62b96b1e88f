"""A run of a plan, the same on every runner (in-process, remote, Lightning): the one replay loop
(``replay``), its evaluations, best selection and early stopping, its history, the progress event
callbacks receive and the result a finished run reports."""
