"""Update rules on flat float32 vectors, shared by the PS (the optimizer it applies) and the workers (the
inner optimizer of local steps): the optimizers, their learning-rate schedules, and the lanes that run a
vector's blocks on several threads."""
