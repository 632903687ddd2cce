"""The reconfiguration controller: desired config -> validate -> plan -> apply -> verify -> record."""
