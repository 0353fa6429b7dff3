"""TODO"""
HELP = "todo"


def add_arguments(parser):
    pass


def run(args):
    print("not yet")
    return 0
