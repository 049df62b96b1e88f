"""What a finished run leaves and says, the same for every runner: the summary files and the
loss-curve picture (``artifacts``, ``loss_curve``) and the words its progress is shown in
(``progress_text``)."""
