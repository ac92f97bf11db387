"""The course around the code: the question bank, exercise mode and the quiz.

    tinyscale exercise list | start TOPIC | check TOPIC    # write a topic's key functions yourself
    tinyscale quiz [--topic T]                             # flash cards from the question bank

`bank` holds the questions (`questions.yaml`, rendered into docs/questions.md), `exercise`
the exercise mode (with `impl`, which puts a learner's code in place of ours for the tests),
`quiz` the flash cards.
"""
