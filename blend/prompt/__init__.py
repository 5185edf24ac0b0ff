"""The prompt: documents, chat conversations, and their layout into segments with explicit positions.
"""
