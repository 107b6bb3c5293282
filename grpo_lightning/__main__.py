"""``python -m grpo_lightning fit|validate|test --config ...``"""

from grpo_lightning.cli import main

if __name__ == "__main__":
    main()
