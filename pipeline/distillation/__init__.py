"""Teaching the decoder a new vocabulary (issue 14): the student's initialisation from the char model."""
