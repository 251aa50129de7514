"""`python -m s4accel ...`, which is also what `accelerate launch -m s4accel train recipe.yaml` runs."""

from s4accel.cli import main

if __name__ == "__main__":
    main()
